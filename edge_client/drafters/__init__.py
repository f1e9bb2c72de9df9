"""The edge's own drafters: the trained MoA drafter's edge half (onnxruntime) and its bundle.
The training-free drafters both sides run are in shared/drafting/."""
