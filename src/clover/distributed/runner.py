"""The runner of one tensor-parallel rank: a `ModelRunner` that knows its group and its shard.

What a rank's runner adds to the one-process runner (runner.py) is all tensor parallelism asks of
the code outside `distributed/`: the state pool is sized from this rank's heads (`state_config`), and
after every generation step the ranks confirm they decided the same (`agree`: one 16-byte
all-gather; `RankDivergence` on every rank when they did not).
"""

from __future__ import annotations

from ..runner import ModelRunner
from .plan import ShardPlan
from .process_group import ParallelGroup


class ShardRunner(ModelRunner):
    def __init__(self, model, plan: ShardPlan, parallel: ParallelGroup, backend=None):
        super().__init__(model, backend)
        self.plan = plan
        self.parallel = parallel
        self.ranks = parallel.world_size
        self.state_config = plan.local_config      # this rank's heads' state only

    def __repr__(self) -> str:
        return f"ShardRunner(rank={self.parallel.rank} of {self.ranks}, backend={self.backend.name!r})"

    def agree(self, digest, what: str) -> None:
        """Check every rank decided the same in step `what`: `digest` a callable giving this rank's
        checksum of the step (generation/decoder.py `step_digest`), or None when the step failed here
        (the others must hear of it rather than wait for this rank)."""
        self.parallel.check_agreement(digest() if digest is not None else None, what)
