"""What a patching experiment measures: logit difference, log-probability, loss or KL to the clean run.

A metric reads the logits of many runs at once ([N, T, V]) and returns one number per run ([N]), averaged over
its positions. `Metric.parse("logit-diff:3,5")` reads the command line's spelling.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

KINDS = ("logit-diff", "logprob", "loss", "kl")


class PatchingError(ValueError):
    """An experiment that cannot run as asked: the message names the problem and the fix in one line."""


@dataclass(frozen=True)
class Metric:
    """kind: one of KINDS. tokens: (A, B) for logit-diff (logit of A minus logit of B), (A,) for logprob.
    positions: the positions averaged over (None: the last position for logit-diff and logprob, every position
    with a next token for loss, every position for kl)."""

    kind: str
    tokens: tuple[int, ...] = ()
    positions: tuple[int, ...] | None = None

    @classmethod
    def parse(cls, text: str, positions: tuple[int, ...] | None = None) -> Metric:
        """'logit-diff:A,B', 'logprob:A', 'loss' or 'kl' -> Metric; PatchingError naming the form otherwise."""
        kind, _, rest = text.strip().partition(":")
        kind = kind.replace("_", "-")
        need = {"logit-diff": 2, "logprob": 1, "loss": 0, "kl": 0}
        if kind not in need:
            raise PatchingError(f"unknown metric {text!r}: use logit-diff:A,B, logprob:A, loss or kl")
        try:
            tokens = tuple(int(s) for s in rest.split(",") if s.strip()) if rest else ()
        except ValueError:
            raise PatchingError(f"metric {text!r}: tokens are integer ids, e.g. logit-diff:3,5") from None
        if len(tokens) != need[kind]:
            form = {"logit-diff": "logit-diff:A,B", "logprob": "logprob:A"}.get(kind, kind)
            raise PatchingError(f"metric {text!r} takes {need[kind]} token id(s): write {form}")
        return cls(kind, tokens, None if positions is None else tuple(int(p) for p in positions))

    @property
    def label(self) -> str:
        return self.kind + (":" + ",".join(map(str, self.tokens)) if self.tokens else "")

    def resolve_positions(self, seq_len: int) -> list[int]:
        """The positions this metric averages over in a sequence of seq_len tokens (negative: from the end)."""
        if self.positions is None:
            if self.kind in ("logit-diff", "logprob"):
                return [seq_len - 1]
            return list(range(seq_len - 1 if self.kind == "loss" else seq_len))
        out = [p + seq_len if p < 0 else p for p in self.positions]
        top = seq_len - 1 if self.kind == "loss" else seq_len
        for p, given in zip(out, self.positions):
            if not 0 <= p < top:
                what = "with a next token " if self.kind == "loss" else ""
                raise PatchingError(f"metric position {given} is out of range: the sequence has {top} positions "
                                    f"{what}(0..{top - 1})")
        return out

    def check(self, vocab_size: int, seq_len: int) -> None:
        """One-line PatchingError for token ids outside the vocabulary or positions outside the sequence."""
        for tok in self.tokens:
            if not 0 <= tok < vocab_size:
                raise PatchingError(f"metric token {tok} is outside the model's vocabulary 0..{vocab_size - 1}")
        if self.kind == "loss" and seq_len < 2:
            raise PatchingError("metric loss needs at least 2 tokens (a position and its next token)")
        self.resolve_positions(seq_len)

    def __call__(self, logits: torch.Tensor, clean_ids: torch.Tensor, clean_logits: torch.Tensor) -> torch.Tensor:
        """The metric of each run: logits [N, T, V] -> [N] (float32, or float64 for float64 logits).

        clean_ids [T] (loss: the clean sequence's next tokens are the targets); clean_logits [T, V] (kl)."""
        dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
        pos = torch.as_tensor(self.resolve_positions(logits.shape[1]), device=logits.device)
        x = logits[:, pos].to(dtype)  # [N, P, V]
        if self.kind == "logit-diff":
            return (x[..., self.tokens[0]] - x[..., self.tokens[1]]).mean(1)
        logp = F.log_softmax(x, -1)
        if self.kind == "logprob":
            return logp[..., self.tokens[0]].mean(1)
        if self.kind == "loss":
            target = clean_ids.to(logits.device)[pos + 1]
            return -logp.gather(-1, target.view(1, -1, 1).expand(len(x), -1, 1))[..., 0].mean(1)
        ref = F.log_softmax(clean_logits[pos].to(dtype), -1)[None]
        return (ref.exp() * (ref - logp)).sum(-1).mean(1)


def normalise(values: torch.Tensor | float, clean: float, corrupted: float) -> torch.Tensor | float:
    """(value - corrupted) / (clean - corrupted): 0 = the corrupted run's metric, 1 = the clean run's
    (NaN where clean and corrupted agree, and nothing can be recovered)."""
    span = clean - corrupted
    if span == 0:
        return values * float("nan")
    return (values - corrupted) / span
