"""Smaller models: GQA, weight quantization, sparsity, pruning, distillation, and the quality measures they are
judged by (lessons 02, 07, 08, 09)."""
