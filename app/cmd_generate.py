"""`deltalab generate CHECKPOINT --prompt TEXT`: continue a prompt with the hooks on, optionally steered or with
states edited while it writes."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from deltalab.app.errors import fail


def parse_steer(spec: str) -> tuple[int, Path, float]:
    """'L:FILE' or 'L:FILE*ALPHA' -> (layer, file, alpha); ValueError naming the expected form."""
    layer, sep, rest = spec.partition(":")
    if not sep or not layer.strip().lstrip("-").isdigit() or not rest:
        raise ValueError(f"--steer {spec!r} is not LAYER:FILE[*ALPHA] (e.g. 3:happy.safetensors*4)")
    path, alpha = rest, 1.0
    head, star, tail = rest.rpartition("*")
    if star:
        try:
            path, alpha = head, float(tail)
        except ValueError:
            raise ValueError(f"--steer {spec!r}: ALPHA {tail!r} is not a number") from None
    return int(layer), Path(path), alpha


def parse_steer_diff(spec: str) -> tuple[int, str, str, float]:
    """'L:POSITIVE|NEGATIVE' or 'L:POSITIVE|NEGATIVE*ALPHA' -> (layer, positive text, negative text, alpha)."""
    layer, sep, rest = spec.partition(":")
    positive, bar, negative = rest.partition("|")
    if not sep or not layer.strip().isdigit() or not bar or not positive or not negative:
        raise ValueError(f"--steer-diff {spec!r} is not LAYER:POSITIVE|NEGATIVE[*ALPHA] (e.g. '2:Love|Hate*4')")
    alpha = 1.0
    head, star, tail = negative.rpartition("*")
    if star:
        try:
            negative, alpha = head, float(tail)
        except ValueError:
            pass  # a '*' inside the text
    return int(layer), positive, negative, alpha


def parse_state(spec: str) -> tuple[int, float]:
    """'L' (erase) or 'L:FACTOR' -> (layer, factor)."""
    layer, sep, factor = spec.partition(":")
    try:
        return int(layer), float(factor) if sep else 0.0
    except ValueError:
        raise ValueError(f"--scale-state {spec!r} is not LAYER[:FACTOR] (e.g. 2:0.5; LAYER alone erases)") from None


def encode_prompt(prompt: str | None, tokens: str | None, checkpoint: Path) -> list[int]:
    """The prompt's token ids: --tokens as given, else --prompt through tokenizer.json (UTF-8 bytes without one)."""
    if (prompt is None) == (tokens is None):
        raise ValueError("pass exactly one of --prompt TEXT and --tokens ID,ID,...")
    if tokens is not None:
        try:
            return [int(t) for t in tokens.replace(",", " ").split()]
        except ValueError:
            raise ValueError(f"--tokens {tokens!r} is not a list of integer token ids (e.g. 1,5,7)") from None
    from deltalab.app.dash.own_input import encode_text
    from deltalab.app.dash.textgrid import tokenizer_file

    return encode_text(prompt, tokenizer_file(checkpoint)).tolist()


def decode(ids: list[int], checkpoint: Path) -> str:
    """Text of token ids through the checkpoint's tokenizer.json, else as UTF-8 bytes (ids >= 256 as <id>)."""
    from deltalab.app.dash.textgrid import tokenizer_file

    tok = tokenizer_file(checkpoint)
    if tok is not None:
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(tok)).decode(ids, skip_special_tokens=False)
    if all(0 <= i < 256 for i in ids):
        return bytes(ids).decode("utf-8", errors="replace")
    return "".join(chr(i) if 32 <= i < 127 else f"<{i}>" for i in ids)


def _text_ids(model, text: str, checkpoint: Path):
    """[1, T] token ids of a --steer-diff text, checked against the vocabulary."""
    import torch

    from deltalab.models.interventions import InterventionError

    ids = encode_prompt(text, None, checkpoint)
    vocab = int(model.config.vocab_size)
    bad = [t for t in ids if not 0 <= t < vocab]
    if not ids or bad:
        raise InterventionError(f"--steer-diff text {text!r} " + (f"has token id {bad[0]} outside the vocabulary "
                                f"0..{vocab - 1}" if bad else "is empty"))
    return torch.tensor([ids], device=next(model.parameters()).device)


def generate_command(
    checkpoint: Path = typer.Argument(..., help="Checkpoint folder (config.json + model.safetensors)."),
    prompt: str | None = typer.Option(None, "--prompt", "-p", help="Text to continue (tokenizer.json, else bytes)."),
    tokens: str | None = typer.Option(None, "--tokens", help="Token ids to continue instead of text: 1,5,7."),
    max_new_tokens: int = typer.Option(32, "--max-new-tokens", "-n", help="Tokens to generate (at least 1)."),
    temperature: float = typer.Option(0.0, "--temperature", help="0: greedy; > 0 samples at this temperature."),
    top_k: int | None = typer.Option(None, "--top-k", help="Sample only from the k most likely tokens."),
    top_p: float | None = typer.Option(None, "--top-p", help="Sample from the smallest set holding this mass."),
    seed: int | None = typer.Option(None, "--seed", help="Seed of the sampler (reproducible samples)."),
    stop: list[int] = typer.Option([], "--stop", help="Token id that ends the generation (repeatable)."),
    steer: list[str] = typer.Option([], "--steer", help="LAYER:FILE[*ALPHA]: add ALPHA times the vector in FILE "
                                    "(safetensors, one tensor) to the residual stream entering LAYER (repeatable)."),
    steer_diff: list[str] = typer.Option([], "--steer-diff", help="LAYER:POSITIVE|NEGATIVE[*ALPHA]: steer along "
                                         "the difference of the two texts' mean residuals entering LAYER."),
    scale_state: list[str] = typer.Option([], "--scale-state", help="LAYER[:FACTOR]: scale that layer's state "
                                          "before every generated token (LAYER alone erases it; repeatable)."),
    device: str = typer.Option("cpu", "--device", help="cpu, cuda, cuda:1 ..."),
    dtype: str | None = typer.Option(None, "--dtype", help="float32, bfloat16, float16, float64 (default: stored)."),
    as_json: bool = typer.Option(False, "--json", help="Print prompt and generated token ids and text as JSON."),
) -> None:
    """Generate a continuation with the hooks on, optionally steered or with states edited at decode time."""
    import torch

    from deltalab.models import CheckpointError, load_checkpoint
    from deltalab.models.generate import GenerationError, generate
    from deltalab.models.interventions import InterventionError, StateEdit, Steering, difference_vector, load_vector

    if max_new_tokens < 1:
        fail(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
    try:
        steers = [parse_steer(s) for s in steer]
        diffs = [parse_steer_diff(s) for s in steer_diff]
        states = [parse_state(s) for s in scale_state]
        ids = encode_prompt(prompt, tokens, checkpoint)
    except ValueError as err:
        fail(str(err))
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
    if dtype is not None and dtype not in dtypes:
        fail(f"--dtype {dtype!r} is not one of {', '.join(dtypes)}")
    try:
        model = load_checkpoint(checkpoint, device=device, dtype=dtypes.get(dtype))
    except CheckpointError as err:
        fail(str(err))
    n_layers = int(model.config.num_hidden_layers)
    interventions = []
    try:
        for layer, path, alpha in steers:
            if not 0 <= layer < n_layers:
                raise InterventionError(f"--steer layer {layer} does not exist: the model has layers 0..{n_layers - 1}")
            interventions.append(Steering(layer, load_vector(path), alpha))
        for layer, positive, negative, alpha in diffs:
            if not 0 <= layer < n_layers:
                raise InterventionError(f"--steer-diff layer {layer} does not exist: the model has layers "
                                        f"0..{n_layers - 1}")
            pair = []
            for text in (positive, negative):
                pair.append(_text_ids(model, text, checkpoint))
            interventions.append(Steering(layer, difference_vector(model, *pair, layer), alpha))
        for layer, factor in states:
            if not 0 <= layer < n_layers or layer not in model.config.delta_layers:
                raise InterventionError(f"--scale-state layer {layer} has no recurrent state: the model's state layers "
                                        f"are {', '.join(map(str, model.config.delta_layers))}")
            interventions.append(StateEdit(layer, factor))
        out = generate(model, [ids], max_new_tokens, do_sample=temperature > 0, temperature=temperature, top_k=top_k,
                       top_p=top_p, seed=seed, stop_tokens=stop, interventions=interventions,
                       progress=not as_json)
    except (GenerationError, InterventionError) as err:
        fail(str(err).replace("max_new_tokens", "--max-new-tokens"))
    new = out.tokens[0]
    if as_json:
        typer.echo(json.dumps({"prompt": ids, "tokens": new, "stopped": out.stopped[0],
                               "text": decode(new, checkpoint)}))
    else:
        typer.echo(decode(ids, checkpoint) + decode(new, checkpoint))
