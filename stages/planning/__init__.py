"""The memory planner behind `stages.plan`: per-device bytes of a training layout (torch-free)."""
