"""A trained model leaving the project: Megatron-LM v2.x and Megatron-Core checkpoints, Hugging Face models,
resharding, generation.

Every converter here works on one canonical form: the *full* state dict of the single-stage,
``t = 1`` model in global parameter names (see :mod:`.names`), with the ``ModelConfig`` that
shapes it.
"""
