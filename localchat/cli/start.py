"""How a command gets its model: the flags it shares (the KV cache's bits, thinking, the hosts
of a split run) and ``session_for``, which loads the model (split over the hosts with
``--hosts``) and says its loading notices. Used by ``cli``'s ask, chat, batch and inspect.
"""

from __future__ import annotations

import argparse
import json
import os

from ..errors import BadInput
from ..fmt import say


def add_kv_flags(p: argparse.ArgumentParser, which: str = "for the conversation") -> None:
    p.add_argument("--kv-bits", type=int, choices=[0, 4, 8], default=None, metavar="{8,4,0}",
                   help=f"store the KV cache {which} quantized to 8 or 4 bits (0: float16); "
                        "remembered; refused if it fails the model's quality gate")
    p.add_argument("--kv-group-size", type=int, choices=[32, 64, 128], default=None,
                   metavar="{32,64,128}", help="quantization group (default: from head dim)")


def add_speculate_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--speculate", choices=["off", "lookup"], default="lookup",
                   help="prompt-lookup decoding: draft the next tokens from the conversation "
                        "and verify them at once (same text, faster where a reply repeats "
                        "it); default lookup")


def add_thinking_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--thinking", choices=["on", "off"], default=None,
                   help="whether a reasoning model thinks first (the template's switch; "
                        "remembered by the conversation)")


def add_keep_alive_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--keep-alive", metavar="DURATION", default=None,
                   help="keep the model loaded in a resident process this long after the "
                   "turn, for the next command (e.g. 90s, 5m, 1h; 0: none, the model loads "
                   "here; default LOCALCHAT_KEEP_ALIVE or 5m)")


def add_constraint_flags(p: argparse.ArgumentParser, what: str = "the reply") -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--format", metavar="json|SCHEMA", default=None,
                   help=f"constrain {what}: 'json' (any JSON object) or a JSON Schema (a file, "
                   "or the schema itself)")
    g.add_argument("--regex", metavar="RE", default=None,
                   help=f"constrain {what} to match RE as a whole")
    g.add_argument("--grammar", metavar="FILE.lark", default=None,
                   help=f"constrain {what} to a Lark grammar (llguidance's dialect)")


def constraint_of(args):
    """The ``ConstraintSpec`` the flags ask for (None: a free reply), checked before any model
    work: a file that cannot be read or a bad schema, regex or grammar is one line."""
    wanted = constraint_request(args)
    if wanted is None:
        return None
    from ..model.constraint import parse_spec

    kind, source, field = wanted
    return parse_spec(kind, source, field=field)


def constraint_request(args) -> tuple[str, str | None, str] | None:
    """What the flags ask for as ``parse_spec``'s (kind, source, field), files read (a file
    that cannot be read is one line) but nothing parsed: what a resident model is sent."""
    fmt, regex, grammar = (getattr(args, k, None) for k in ("format", "regex", "grammar"))
    if fmt is None and regex is None and grammar is None:
        return None
    if regex is not None:
        return "regex", regex, "--regex"
    if grammar is not None:
        return "grammar", _read(grammar, "--grammar"), "--grammar"
    if fmt.strip() == "json":
        return "json_object", None, "--format"
    inline = fmt.lstrip()[:1] in ("{", "[", '"') or fmt.strip() in ("true", "false")
    return "json_schema", fmt if inline else _read(fmt, "--format"), "--format"


def _read(path: str, flag: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as err:
        why = getattr(err, "strerror", None) or "not UTF-8 text"
        raise BadInput(f"{flag}: cannot read {path}: {why}") from None


def thinking_setting(session, args) -> bool | None:
    """The --thinking flag as a setting; a notice when the model's template has no switch."""
    choice = getattr(args, "thinking", None)
    if choice is None:
        return None
    if not session.engine.thinking_switch:
        say(f"{session.model_name}'s chat template has no thinking switch; --thinking "
            "changes nothing")
    return choice == "on"


def add_cluster_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hosts", metavar="IP,IP,...",
                   help="split the model over these machines (the first is this one; "
                        "127.0.0.1,127.0.0.1 tries it here); see 'Bigger than one machine'")
    p.add_argument("--hostfile", metavar="FILE",
                   help="the hosts as mlx.launch's JSON ([{\"ssh\": …, \"ips\": […]}, …])")
    p.add_argument("--shard", choices=["auto", "tensor", "pipeline"], default="auto",
                   help="split by attention heads (tensor) or by layers (pipeline); auto: "
                        "heads when the model allows")


def start_cluster(args, model: str | None):
    """With --hosts/--hostfile: start the followers and join them (``launch.start``);
    the group to load the model over, or None for one process."""
    if not (getattr(args, "hosts", None) or getattr(args, "hostfile", None)):
        return None
    from ..cluster import launch, split
    from ..cpu import backend
    from ..model.resolve import resolve

    hosts = launch.parse_hosts(args.hosts, args.hostfile)
    if getattr(args, "kv_bits", None) is not None:
        raise BadInput("--kv-bits is set without --hosts (its quality check runs the whole "
                       "model in one process); the setting is kept when split")
    if getattr(args, "parallel", 1) > 1:
        raise BadInput("--parallel runs in one process; not with --hosts")
    here = sum(h.ip in launch.LOOPBACK for h in hosts)
    if here > 1 and "OPENBLAS_NUM_THREADS" not in os.environ:
        # Ranks sharing this machine share its cores: BLAS threads that outnumber them spin
        # while they wait and starve the other rank (a pipeline prefill ran ~20x slower).
        os.environ["OPENBLAS_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // here))
    backend.prepare()
    ref = resolve(model, progress=say)
    try:
        config = json.loads((ref.path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise BadInput(f"cannot read {ref.name}'s config.json: {err}") from None
    shard = split.check_shard(config, args.shard, len(hosts), ref.name)
    local = all(h.ip in launch.LOOPBACK for h in hosts)
    # Followers on this machine load the same folder; elsewhere they resolve the name.
    ring = launch.start(hosts, shard, str(ref.path) if local else model, say)
    say(f"{ref.name} split by {'heads' if shard == 'tensor' else 'layers'} over "
        f"{ring.size} ranks")
    return ring


def session_for(model: str | None, args=None):
    """The session of every command that runs a model; loading notices go to stderr.
    With --hosts, the model is split over the hosts (``start_cluster``)."""
    group = start_cluster(args, model)
    if group is None:
        from ..model.preload import preload

        preload(model)  # the CPU weights are read while the session's modules import
    from ..session.session import open_session

    session = open_session(model, progress=say, group=group)
    for text in session.start_notices():
        say(text)
    return session
