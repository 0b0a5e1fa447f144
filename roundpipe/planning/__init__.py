"""The planning layer: which layers form each stage (``ModelExecutePlan``), how the planner cuts them from measured or
estimated times (``planner``, ``plan_choice``, ``simulate``), the per-layer timings it learns from (``timer``), and
the memory a run needs and may use (``estimate``, ``budget``). It decides; it runs nothing on the devices.
"""
