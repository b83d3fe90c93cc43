"""The course's tooling, never imported by the engine: grading, hints, the checkpoint seams, lesson helpers."""
