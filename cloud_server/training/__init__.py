"""Drafter training, offline: prompts answered by the target (data.py; or many at once through
the static engine with the drafter's features captured in the same forwards, engine_answers.py,
read back by features.py), batches (batches.py), the random verified boundary (boundaries.py),
the MoA distillation loop with checkpoints and progress (moa.py), and `cloud-server
train-drafter` (cli.py). The running server never imports this package
(tests/test_layering.py); each drafter's model, export and serving live with the drafter
(cloud_server/moa/)."""
