"""`generate`: greedy or sampled continuation of prompts, with the hooks on and interventions applied.

deltalab's own models (every fla-format family: DeltaNet, Gated DeltaNet, Gated DeltaProduct, KDA, RWKV-7 and the
softmax hybrids) decode through `models.cache.RecurrentCache`: one prefill over each prompt (the chunked / Triton
forward), then one O(1) step per token. Prompts of different lengths are prefilled in groups of equal length and
their caches stacked, so rows never see padding. `use_cache=False` runs the whole sequence again at every step (the
reference that cached decoding must equal). transformers models (`models.hf.HookedHFModel`) decode through
transformers' own `generate` and cache, with deltalab's hooks and the same interventions on.

Every hook fires at every step with the names and shapes of a full forward (T = 1 per decode step); on a one-token
step `hook_state` is [B, 2, Hv, K, V], the state before the token and after it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from deltalab.models.cache import RecurrentCache
from deltalab.models.interventions import Intervention, StepContext, applied, hook_module


class GenerationError(ValueError):
    """Bad generation input: the message names the problem and the fix."""


@dataclass
class GenerationOutput:
    """What `generate` returns, rows in the order of the prompts."""

    prompts: list[list[int]]
    """Each row's prompt token ids."""
    tokens: list[list[int]]
    """Each row's generated token ids, up to and including its stop token."""
    stopped: list[bool]
    """Whether the row ended on a stop token (else it ran to max_new_tokens)."""
    logits: torch.Tensor | None = None
    """[B, N, vocab] float32: the logits each step chose from (with `output_logits=True`); rows that stopped
    early repeat their stop step's logits."""
    records: dict[str, list[tuple[int, torch.Tensor]]] = field(default_factory=dict)
    """hook name -> (step, value) at every forward call, for the hooks named in `record` (rows of a prefill
    group only, in the order of the prompts within the group)."""

    @property
    def sequences(self) -> list[list[int]]:
        """Prompt + generated tokens of each row."""
        return [p + t for p, t in zip(self.prompts, self.tokens)]


class Generates:
    """`model.generate(input_ids, max_new_tokens, **options)` on deltalab's models: `models.generate.generate`.

    nnsight traces it as any method: `with NNsight(model).trace(ids, fn=model.generate, max_new_tokens=8) as
    tracer:` then `for step in tracer.iter[0:8]:` reads or edits each step's hooks."""

    def generate(self, input_ids: Any, max_new_tokens: int = 20, **options: Any) -> GenerationOutput:
        return generate(self, input_ids, max_new_tokens, **options)  # type: ignore[arg-type]


def _as_rows(input_ids: Any, attention_mask: torch.Tensor | None) -> list[list[int]]:
    """Per-row prompt ids from [B, T] (left padding marked 0 in attention_mask), [T], or lists of ids."""
    if isinstance(input_ids, torch.Tensor):
        ids = input_ids if input_ids.dim() == 2 else input_ids.reshape(1, -1)
        if ids.dtype.is_floating_point:
            raise GenerationError(f"input_ids must hold integer token ids, got {ids.dtype}")
        if attention_mask is None:
            return [row.tolist() for row in ids]
        if attention_mask.shape != ids.shape:
            raise GenerationError(f"attention_mask has shape {tuple(attention_mask.shape)}, input_ids "
                                  f"{tuple(ids.shape)}: pass one mask entry per token")
        return [row[m.bool()].tolist() for row, m in zip(ids, attention_mask)]
    rows = list(input_ids)
    if rows and not isinstance(rows[0], (list, tuple, torch.Tensor)):
        rows = [rows]
    return [list(map(int, r.tolist() if isinstance(r, torch.Tensor) else r)) for r in rows]


def check_request(model: nn.Module, rows: list[list[int]], max_new_tokens: int, temperature: float,
                  top_k: int | None, top_p: float | None) -> None:
    """One-line GenerationErrors for requests the model cannot serve."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise GenerationError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if not rows:
        raise GenerationError("no prompts given: pass at least one prompt of token ids")
    vocab = int(model.config.vocab_size)
    limit = getattr(model.config, "max_position_embeddings", None)
    for r, row in enumerate(rows):
        if not row:
            raise GenerationError(f"prompt {r} is empty: give every prompt at least one token")
        bad = [t for t in row if not 0 <= t < vocab]
        if bad:
            raise GenerationError(f"prompt {r} has token id {bad[0]} outside the vocabulary 0..{vocab - 1}")
        if limit and len(row) + max_new_tokens > int(limit):
            raise GenerationError(f"prompt {r} has {len(row)} tokens; with {max_new_tokens} new ones that passes the "
                                  f"model's max_position_embeddings={limit}: shorten the prompt or max_new_tokens")
    if temperature < 0:
        raise GenerationError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and top_k < 1:
        raise GenerationError(f"top_k must be >= 1, got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise GenerationError(f"top_p must be in (0, 1], got {top_p}")


def choose(logits: torch.Tensor, do_sample: bool, temperature: float, top_k: int | None, top_p: float | None,
           generator: torch.Generator | None) -> torch.Tensor:
    """Next tokens [B] from logits [B, vocab]: the argmax, or a sample at `temperature` from the `top_k` most
    likely tokens and the smallest set holding `top_p` of the probability (transformers' order of the filters)."""
    if not do_sample or temperature == 0:
        return logits.argmax(-1)
    scores = logits.float() / temperature
    if top_k is not None and top_k < scores.shape[-1]:
        kth = scores.topk(top_k, -1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, -torch.inf)
    if top_p is not None and top_p < 1:
        ordered, index = scores.sort(-1, descending=True)
        mass = ordered.softmax(-1).cumsum(-1)
        drop = mass - ordered.softmax(-1) >= top_p  # tokens whose predecessors already hold top_p
        scores = scores.scatter(-1, index, ordered.masked_fill(drop, -torch.inf))
    probs = scores.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _groups(rows: list[list[int]]) -> list[list[int]]:
    """Row indices grouped by prompt length (longest first), each group in prompt order."""
    by_len: dict[int, list[int]] = {}
    for i, row in enumerate(rows):
        by_len.setdefault(len(row), []).append(i)
    return [by_len[n] for n in sorted(by_len, reverse=True)]


@torch.no_grad()
def generate(model: nn.Module, input_ids: Any, max_new_tokens: int = 20, *,
             attention_mask: torch.Tensor | None = None, do_sample: bool = False, temperature: float = 1.0,
             top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
             stop_tokens: Sequence[int] | int | None = None, interventions: Sequence[Intervention] = (),
             record: Sequence[str] = (), use_cache: bool = True, output_logits: bool = False,
             progress: bool = False) -> GenerationOutput:
    """Continue each prompt by up to `max_new_tokens` tokens.

    input_ids: [B, T] token ids (with `attention_mask` [B, T] marking left padding 0), a 1-D prompt, or a list of
    prompts of any lengths. Greedy unless `do_sample` (then `temperature`, `top_k`, `top_p`, `seed`, as in
    transformers). A row ends after any of `stop_tokens`. `interventions` (`models.interventions`: Steering,
    StateEdit, HookEdit) apply at the steps they name; `record` lists hook names whose values are kept at every
    forward call. `use_cache=False` recomputes the full sequence each step (the reference).
    """
    rows = _as_rows(input_ids, attention_mask)
    check_request(model, rows, max_new_tokens, temperature, top_k, top_p)
    stops = [] if stop_tokens is None else [stop_tokens] if isinstance(stop_tokens, int) else list(stop_tokens)
    device = next(model.parameters()).device
    generator = None if seed is None else torch.Generator(device=device).manual_seed(int(seed))
    if hasattr(model, "hf"):
        return _generate_hf(model, rows, max_new_tokens, do_sample=do_sample, temperature=temperature, top_k=top_k,
                            top_p=top_p, seed=seed, stops=stops, interventions=interventions, record=record,
                            use_cache=use_cache, output_logits=output_logits)
    groups = _groups(rows)
    order = [i for g in groups for i in g]  # the working row order: groups contiguous
    B = len(rows)
    prompts = [torch.tensor(rows[i], dtype=torch.long, device=device) for i in order]
    ctx = StepContext()
    records: dict[str, list[tuple[int, torch.Tensor]]] = {name: [] for name in record}
    handles = [hook_module(model, name).register_forward_hook(
        lambda _m, _a, out, name=name: records[name].append((ctx.step, out.detach().clone()))) for name in record]
    new = torch.zeros(B, 0, dtype=torch.long, device=device)
    done = torch.zeros(B, dtype=torch.bool, device=device)
    stop_t = torch.tensor(stops, dtype=torch.long, device=device)
    pad = int(model.config.pad_token_id or 0)
    step_logits = []
    bar = _progress(max_new_tokens, progress)
    try:
        with applied(model, interventions, ctx):
            cache = None
            for step in range(max_new_tokens):
                ctx.step = step
                if use_cache and step > 0:
                    ctx.token_steps = torch.tensor([step], device=device)
                    logits = model(new[:, -1:], cache=cache).logits[:, -1]
                else:
                    logits, caches = _full_pass(model, prompts, groups, new, ctx, use_cache)
                    if use_cache:
                        cache = caches[0] if len(caches) == 1 else RecurrentCache.stack(caches)
                nxt = choose(logits, do_sample, temperature, top_k, top_p, generator)
                if step_logits and done.any():
                    logits = torch.where(done[:, None], step_logits[-1].to(logits.device), logits)
                if output_logits:
                    step_logits.append(logits.float())
                nxt = torch.where(done, torch.full_like(nxt, pad), nxt)
                new = torch.cat([new, nxt[:, None]], 1)
                done = done | torch.isin(nxt, stop_t)
                if bar is not None:
                    bar.update(1)
                if bool(done.all()):
                    break
    finally:
        for h in handles:
            h.remove()
        if bar is not None:
            bar.close()
    return _output(rows, order, new.tolist(), stops, step_logits, records)


def _full_pass(model, prompts, groups, new, ctx: StepContext, use_cache: bool):
    """Logits [B, vocab] at each row's last token from whole-sequence forwards, one per prompt-length group
    (with fresh caches filled when `use_cache`: the prefill)."""
    out, caches, start = [], [], 0
    for g in groups:
        rows = slice(start, start + len(g))
        start += len(g)
        ids = torch.cat([torch.stack(prompts[rows]), new[rows]], 1)
        P, n = prompts[rows.start].numel(), new.shape[1]
        ctx.token_steps = torch.cat([torch.zeros(P, dtype=torch.long), torch.arange(1, n + 1)]).to(ids.device)
        if use_cache:
            caches.append(RecurrentCache(len(model.layers)))
            out.append(model(ids, cache=caches[-1]).logits[:, -1])
        else:
            out.append(model(ids).logits[:, -1])
    return torch.cat(out), caches


def _output(rows, order, new_rows, stops, step_logits, records) -> GenerationOutput:
    """Rows back in prompt order, each cut after its first stop token."""
    B = len(rows)
    tokens, stopped = [[] for _ in range(B)], [False] * B
    for k, i in enumerate(order):
        toks = new_rows[k]
        cut = next((j for j, t in enumerate(toks) if t in stops), None)
        tokens[i] = toks if cut is None else toks[: cut + 1]
        stopped[i] = cut is not None
    logits = None
    if step_logits:
        inverse = torch.tensor([order.index(i) for i in range(B)])
        logits = torch.stack(step_logits, 1)[inverse.to(step_logits[0].device)]
    return GenerationOutput(prompts=[list(r) for r in rows], tokens=tokens, stopped=stopped, logits=logits,
                            records=records)


def _generate_hf(model, rows, max_new_tokens, *, do_sample, temperature, top_k, top_p, seed, stops,
                 interventions, record, use_cache, output_logits) -> GenerationOutput:
    """The same request through transformers' `generate` (its cache; left padding with an attention mask),
    with deltalab's hooks, the interventions and the records on; a pre-hook on the transformers model counts
    the steps."""
    device = next(model.parameters()).device
    pad = int(model.config.pad_token_id if model.config.pad_token_id is not None else 0)
    P = max(len(r) for r in rows)
    ids = torch.full((len(rows), P), pad, dtype=torch.long, device=device)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, P - len(r):] = torch.tensor(r, device=device)
        mask[i, P - len(r):] = 1
    ctx = StepContext(step=-1)
    records: dict[str, list[tuple[int, torch.Tensor]]] = {name: [] for name in record}

    def count(_mod, args, kwargs):
        ctx.step += 1
        x = kwargs.get("input_ids", args[0] if args else None)
        T = x.shape[1] if x is not None else 1
        steps = torch.cat([torch.zeros(P, dtype=torch.long), torch.arange(1, ctx.step + 1)])
        ctx.token_steps = steps[-T:].to(device)

    handles = [model.hf.register_forward_pre_hook(count, with_kwargs=True)]
    handles += [hook_module(model, name).register_forward_hook(
        lambda _m, _a, out, name=name: records[name].append((ctx.step, out.detach().clone()))) for name in record]
    if seed is not None:
        torch.manual_seed(int(seed))
    options: dict[str, Any] = dict(max_new_tokens=max_new_tokens, min_new_tokens=0, do_sample=do_sample,
                                   use_cache=use_cache, pad_token_id=pad, return_dict_in_generate=True,
                                   output_logits=output_logits, eos_token_id=list(stops) or None)
    if do_sample:
        options.update(temperature=temperature, top_k=top_k or 0, top_p=1.0 if top_p is None else top_p)
    try:
        with applied(model, interventions, ctx):
            out = model.generate(input_ids=ids, attention_mask=mask, **options)
    finally:
        for h in handles:
            h.remove()
    new_rows = out.sequences[:, P:].tolist()
    step_logits = list(out.logits) if output_logits and out.logits else []
    return _output(rows, list(range(len(rows))), new_rows, stops, step_logits, records)


def _progress(total: int, on: bool):
    if not on:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="generate", unit="tok")
