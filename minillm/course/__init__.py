"""The course's tooling, never imported by the engine: grading, hints, the checkpoint ladder, lesson helpers."""
