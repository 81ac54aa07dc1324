"""Training's random stream: dropout's generator, kept apart from the caller's.

Every rank builds the model from `parc.compile(seed=...)`, so the generators all
end the build in one state. Left so, every dp replica would draw the same dropout
masks for its samples and every pipeline stage the same masks for its layers
(correlated noise one device never has). So each (dp replica, pipeline stage) gets
a stream of its own; the ranks of a tp group share one (a dropout on a replicated
activation must drop the same elements on each of them, or the replicas of that
activation drift apart), and replica 0 of stage 0 keeps the single-device stream:
the generator as the build left it.

The stream is the Program's, not torch's global generator: `Program.step` swaps it
in around the step's forwards and backwards and swaps the caller's back after, and
`parc.compile` gives the caller's generators back as they were before it. A user's
loop that seeds or draws from the global generator between steps (`torch.manual_seed
(base + rank)`, a habit) left a tp group's ranks with different streams: its
replicated weights drifted apart, silently (found by a probe). Now it moves nothing
training draws, and training moves nothing of the caller's.

A checkpoint saves each rank's stream and a load under the same mesh restores it
(runtime/checkpoint/rng.py), so a resumed run draws the masks the uninterrupted one
draws: before, a resume restarted the streams from the seed (other masks, other losses).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

__all__ = ["RandomState", "training_stream"]


@dataclass(slots=True)
class RandomState:
    """The CPU generator's state and, on a CUDA device, that device's generator's."""

    device: torch.device
    cpu: torch.Tensor
    cuda: torch.Tensor | None

    @staticmethod
    def capture(device: torch.device) -> RandomState:
        cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        return RandomState(device, torch.get_rng_state(), cuda)

    def states(self) -> dict[str, torch.Tensor]:
        """The generators' states by device type, as a checkpoint stores them: "cpu", and
        "cuda" on a CUDA device (each a 1-d uint8 tensor)."""
        states = {"cpu": self.cpu}
        if self.cuda is not None:
            states["cuda"] = self.cuda
        return states

    def continue_from(self, states: Mapping[str, torch.Tensor]) -> None:
        """Draw on from `states` (as `states()` gives them: a saved stream's)."""
        self.cpu = states["cpu"].clone()
        if self.cuda is not None:
            self.cuda = states["cuda"].clone()

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, self.device)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Draw from this state in the block (it moves on as drawn); the generators' own
        states are given back after."""
        saved = RandomState.capture(self.device)
        self.restore()
        try:
            yield
        finally:
            moved = RandomState.capture(self.device)
            self.cpu, self.cuda = moved.cpu, moved.cuda
            saved.restore()


def training_stream(seed: int, dp_index: int, pp_index: int, device: torch.device) -> RandomState:
    """This rank's training stream, right after the model was built from `seed` (the
    generators as the build left them): replica 0 of stage 0 keeps that state."""
    if dp_index == 0 and pp_index == 0:
        return RandomState.capture(device)
    stream = (seed * 1_000_003 + dp_index * 7_919 + pp_index * 104_729 + 1) % 2**63
    forked = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=forked):
        torch.manual_seed(stream)
        return RandomState.capture(device)
