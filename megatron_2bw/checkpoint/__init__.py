"""Checkpoints: the Megatron directory layout, the ``torch`` and ``torch_dist`` formats, the manifest and
the save guard, the Megatron names of every weight and resharding between layouts.

One package so that a format is one module registered under its ``--ckpt-format`` name and the layout
is stated once; ``export/`` keeps only what leaves the project (HF, Megatron-Core, generation).
"""
