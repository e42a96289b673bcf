"""The measurements the engine's options are settled from (`infer.policy`) and trees are calibrated with
(`infer.tree_choice`), one job a module:

- `cache`: the per-machine cache every timing is stored in;
- `timing`: the timing harness and the costs of a forward, a verify step, a drafting step and a step of the engine;
- `acceptance`: a drafter's acceptance on held-out prompts, and prompt lookup first timed against it;
- `candidates`: the trees acceptance statistics allow, and the choice among them by predicted speed;
- `plan`: the engine's plan where no generation needs timing (the drafter, kernels, the lean verify forward).
"""
