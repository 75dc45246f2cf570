"""launch.train with one rank stuck in a step (for the watchdog test): `torchrun ... -m tests.hang_worker
STUCK_RANK STUCK_STEP --config ...`. The sleep is injected here, not in the trainer."""

import os
import sys
import time

from launch.train import main
from moe_pretrain.training import Trainer

if __name__ == "__main__":
    stuck_rank, stuck_step, *argv = sys.argv[1:]
    original = Trainer.train_step

    def train_step(self):
        if os.environ.get("RANK") == stuck_rank and self.step + 1 == int(stuck_step):
            time.sleep(600)
        return original(self)

    Trainer.train_step = train_step
    sys.exit(main(argv))
