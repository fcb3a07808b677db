"""``localchat serve`` whose model's replies are scripted (``SCRIPTED_REPLIES``, a JSON list):
the tiny real model computes every K/V; only the choice of tokens is scripted, so tests can
make a model call a tool. Run as ``python scripted_serve.py serve ARGS…`` (``test_server``)."""

import json
import os
import sys

from localchat.cpu import backend

backend.prepare()

from fakes import ScriptedEngine  # noqa: E402

from localchat.cli.main import main  # noqa: E402
from localchat.model.engine import Engine  # noqa: E402

_load = Engine.load.__func__
REPLIES = json.loads(os.environ["SCRIPTED_REPLIES"])


def load(cls, name=None, progress=None, *, group=None):
    return ScriptedEngine(_load(cls, name, progress, group=group), list(REPLIES))


Engine.load = classmethod(load)
sys.exit(main(sys.argv[1:]))
