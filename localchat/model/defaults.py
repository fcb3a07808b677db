"""How a reply is sampled when the caller leaves it open: the model's advice, then localchat's.

What it is: ``model_defaults`` — the sampling settings the app and ``serve`` use for what a
user or a request leaves unset: each field from the model folder's ``generation_config.json``
(what its makers recommend: ``temperature``, ``top_p``, ``top_k``, ``min_p``,
``repetition_penalty``, ``max_new_tokens``; ``do_sample: false`` means greedy) when present and
valid, else localchat's own default below; with where each came from (``inspect`` shows it).
A value of the wrong type or out of range is left out with one notice. What it is not: the
sampler (mlx-lm's ``make_sampler``, called by ``Engine.decode``), or ``ask``/``batch``, which
stay greedy unless ``--temp`` (scripts must be reproducible).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

MODEL = "generation_config.json"
OURS = "localchat default"
# A generation_config.json localchat wrote itself (the converted default model has none from
# its makers: ``gguf.write_sampling_advice`` puts their model card's advice there) carries this
# key: ``{"version": N, "source": "…"}``. It holds sampling advice only, which no cached K/V
# depends on, so the model digest leaves it out (``models.model_digest``): writing it into a
# folder converted earlier keeps every conversation's cache valid.
WRITTEN = "localchat"

# localchat's own defaults, for a model that recommends nothing: a mild temperature with a
# nucleus cut (greedy makes small models loop; 1.0 made SmolLM2 answer "Gabon" for France's
# capital), and a cap on every reply so a model that never ends cannot fill the context.
REPLY_CAP = 2048
LOCALCHAT = {"temperature": 0.7, "top_p": 0.9, "top_k": 0, "min_p": 0.0,
             "repetition_penalty": 1.0, "max_tokens": REPLY_CAP}

# field -> (generation_config.json key, type, low, high, low excluded)
FIELDS = {
    "temperature": ("temperature", float, 0.0, 5.0, False),
    "top_p": ("top_p", float, 0.0, 1.0, True),
    "top_k": ("top_k", int, 0, 1_000_000, False),
    "min_p": ("min_p", float, 0.0, 1.0, False),
    "repetition_penalty": ("repetition_penalty", float, 0.0, 10.0, True),
    "max_tokens": ("max_new_tokens", int, 1, 10_000_000, False),
}


@dataclass(frozen=True)
class Sampling:
    """Sampling settings in force, with each one's source (``MODEL`` or ``OURS``)."""

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    max_tokens: int  # the cap of a reply whose request names none
    sources: dict[str, str] = field(default_factory=dict)
    notices: tuple[str, ...] = ()  # values of the file that were left out, one line each

    def turn_fields(self, *, max_tokens: int | None = None, temp: float | None = None,
                    top_p: float | None = None, top_k: int | None = None,
                    min_p: float | None = None, repetition_penalty: float | None = None
                    ) -> dict:
        """``TurnOptions`` keywords: what the caller set, these defaults for the rest."""
        def pick(given, default):
            return default if given is None else given

        return {"max_tokens": pick(max_tokens, self.max_tokens),
                "temp": pick(temp, self.temperature), "top_p": pick(top_p, self.top_p),
                "top_k": pick(top_k, self.top_k), "min_p": pick(min_p, self.min_p),
                "repetition_penalty": pick(repetition_penalty, self.repetition_penalty)}

    def describe(self) -> list[str]:
        """One line per field: ``temperature 0.6 (generation_config.json)``."""
        return [f"{name} {getattr(self, name)} ({self.sources.get(name, OURS)})"
                for name in FIELDS]


def model_defaults(folder: Path | None) -> Sampling:
    """The sampling defaults of the model in ``folder`` (see the module docstring)."""
    given, notices = _read(folder)
    values, sources = dict(LOCALCHAT), {name: OURS for name in FIELDS}
    for name, (key, kind, low, high, low_open) in FIELDS.items():
        if given.get(key) is None:  # absent or null: the file says nothing
            continue
        value = given[key]
        if not _fits(value, kind, low, high, low_open):
            notices.append(f"{MODEL}: {key} {json.dumps(value)[:40]} is not "
                           f"{'an integer' if kind is int else 'a number'} in "
                           f"{'(' if low_open else '['}{low}, {high}]; using localchat's "
                           f"{LOCALCHAT[name]}")
            continue
        values[name], sources[name] = kind(value), _named(given)
    if given.get("do_sample") is False:
        # The makers say greedy: any temperature the file names is not for sampling.
        values["temperature"], sources["temperature"] = 0.0, f"{MODEL} (do_sample: false)"
    return Sampling(**values, sources=sources, notices=tuple(notices))


def _named(given: dict) -> str:
    """``generation_config.json``, with the source localchat wrote into it (``WRITTEN``)."""
    mark = given.get(WRITTEN)
    source = mark.get("source") if isinstance(mark, dict) else None
    if isinstance(source, str) and source.strip():
        return f"{MODEL}: {source.strip()[:80]}"
    return MODEL


def _read(folder: Path | None) -> tuple[dict, list[str]]:
    if folder is None:
        return {}, []
    path = Path(folder) / MODEL
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}, []
    except (OSError, ValueError) as err:
        return {}, [f"{MODEL} cannot be read ({type(err).__name__}); using localchat's "
                    "sampling defaults"]
    if not isinstance(data, dict):
        return {}, [f"{MODEL} is not an object; using localchat's sampling defaults"]
    return data, []


def _fits(value, kind, low, high, low_open: bool) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    if kind is int and not isinstance(value, int):
        return False
    if value != value:  # NaN
        return False
    return (value > low if low_open else value >= low) and value <= high
