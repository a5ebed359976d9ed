"""An async PPO loop on Ray whose rollouts receive the trainers' weights through weightsync every step.

Modules, one idea each: ``task`` (digit-sum task, verifiable reward, chance level), ``model`` (the policy
in the trainers' and the rollouts' fused layouts), ``ppo`` (clipped objective, group baseline),
``trainer`` (FSDP2 trainer ranks, ``ws.Source``), ``rollout`` (generating rollout ranks,
``ws.Destination``), ``main`` (driver, CLI, progress, plot, JSON summary).
"""
