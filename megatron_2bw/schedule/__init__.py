"""The schedule floor: torch-free facts about pipeline programs.

Actions and their text form, placements of virtual stages on ranks, the schedule registry and its
programs, the one replay engine behind the checker, the NCCL-order proof, the simulator and the
planner's bubble, the recomputation policy and the split of layers into stages. Nothing here imports
torch, so ``config.py``, the planner and the tools read these facts without the engine.
"""
