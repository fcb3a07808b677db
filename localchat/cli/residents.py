"""``localchat ps`` and ``localchat stop``: the resident model processes of this data folder.

What it is: ``residents()`` reads the info files under ``run/`` and asks each resident for its
status over its socket (one it cannot reach is gone: its files are removed when its process
is); ``cmd_ps`` prints them (``--json``: one object per line), ``cmd_stop`` asks them to exit
(their running turns stop after the current token, replies kept) and waits until they have.
What it is not: the resident (``resident/daemon.py``).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from ..fmt import say
from ..resident import place as places
from ..resident import wire


def residents() -> list[dict]:
    """The status of each resident of this data folder (oldest first)."""
    found = []
    folder = places.run_dir()
    for info_path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        info = places.read_info(info_path)
        if info is None or not all(isinstance(info.get(k), str) for k in ("home", "model",
                                                                           "key")):
            continue
        place = places.Place(Path(info["home"]), info["model"], info["key"])
        status = ask_status(place)
        if status is None:
            if not alive(info["pid"]):  # gone without tidying up (killed)
                places.remove_if(place.info)
                places.remove_if(place.sock)
            continue
        found.append({**status, "place": place})
    return sorted(found, key=lambda s: s.get("started", 0))


def ask_status(place: places.Place, op: str = "status") -> dict | None:
    try:
        conn = places.connect(place, timeout=2.0)
    except OSError:
        return None
    try:
        conn.settimeout(5.0)
        conn.sendall(wire.request_line(op))
        raw = conn.makefile("rb").readline(wire.MAX_LINE)
        obj = json.loads(raw) if raw else None
        return obj if isinstance(obj, dict) else None
    except (OSError, ValueError):
        return None
    finally:
        conn.close()


def alive(pid) -> bool:
    if type(pid) is not int or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cmd_ps(args) -> int:
    """The resident model processes of this data folder: model, memory, idle time, turns
    answered, and how long each stays (its keep-alive left)."""
    found = residents()
    if args.json:
        for s in found:
            s.pop("place")
            print(json.dumps({k: v for k, v in s.items() if k != "t"}, ensure_ascii=False))
        return 0
    if not found:
        say("no resident model process (the next `ask` starts one; --keep-alive 0: none)")
        return 0
    print(f"{'PID':>7}  {'MODEL':<24} {'MEMORY':>8} {'TURNS':>6} {'IDLE':>7} {'STAYS':>7}")
    for s in found:
        state = "" if s.get("ready") else "  (loading)"
        print(f"{s.get('pid', 0):>7}  {str(s.get('model', ''))[:24]:<24} "
              f"{_size(s.get('memory', 0)):>8} {s.get('turns', 0):>6} "
              f"{_secs(s.get('idle_s', 0)):>7} {_secs(s.get('keep_alive_left_s', 0)):>7}"
              f"{state}")
    return 0


def cmd_stop(args) -> int:
    """Stop the resident model processes of this data folder (MODEL: only that model's);
    their running turns stop after the current token and keep their replies."""
    want = places.model_key(args.model) if args.model else None
    stopped = 0
    for s in residents():
        if want is not None and s.get("model") != want:
            continue
        answer = ask_status(s["place"], "stop")
        if answer is None:
            continue
        deadline = time.monotonic() + 30
        while alive(s.get("pid")) and time.monotonic() < deadline:
            time.sleep(0.05)
        say(f"stopped {s.get('model')} (pid {s.get('pid')})")
        stopped += 1
    if not stopped:
        say("no resident model process" + (f" for {args.model}" if want else ""))
    return 0


def _size(n) -> str:
    n = float(n or 0)
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit in ("B", "KB") else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


def _secs(s) -> str:
    s = float(s or 0)
    return f"{s:.0f}s" if s < 90 else f"{s / 60:.0f}m" if s < 5400 else f"{s / 3600:.1f}h"
