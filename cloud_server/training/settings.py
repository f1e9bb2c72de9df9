"""What one drafter training run is told: steps, batch size, loss weights and which students
train (moa.py). A module of its own so that the losses (distill.py, sar.py) read it without
importing the trainer that calls them."""
from __future__ import annotations

from dataclasses import dataclass

from cloud_server.moa.config import ServerInput


@dataclass(frozen=True)
class TrainSettings:
    steps: int = 1000  # 1.5-2.5 s each for SmolLM2 on this 2-core CPU
    batch_tokens: int = 1024  # padded tokens per batch (prompt + answer)
    max_len: int = 416  # a sequence is cut to this many tokens
    lr: float = 1e-3
    warmup: int = 30
    kl_weight: float = 1.0
    feature_weight: float = 1.0
    draft_vocab: int = 8192  # sub-vocabulary head size (0 or >= the vocab: the full head)
    init_from_target: bool = True  # SA and CA start from the target's first and last layers
    # one MoA student per input; the first is written to OUT, the others to OUT/<input>
    server_inputs: tuple[ServerInput, ...] = (ServerInput.LAST_HIDDEN,)
    lsa_stride: int = 1  # LSA students read every lsa_stride-th layer's K/V (1: all, the paper's)
    tli_layers: int = 0  # MoA students end in the target's last N layers (Target Layer Inference)
    independent: bool = False  # also train the Independent baseline (written to OUT/independent)
    recurrent: bool = False  # MoA students feed their own output back (input 'last' only)
    unroll: int = 4  # draft depths a recurrent student trains at, one pass each (unroll.py)
    depth_weight: float = 1.0  # depth k's loss weighs depth_weight ** (k - 1)
    block: int = 1  # tokens drafted per step: more than 1 trains Falcon's drafter (sar.py)
    glance: float = 0.45  # Falcon's glancing rate lambda at the start (sar.py); 0: none
    checkpoint_every: int = 50
    snapshot_every: int = 0  # also write every student's weights to OUT/snapshots/step-N (0: off)
    seed: int = 0
