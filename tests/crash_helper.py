"""Run ``localchat ask`` in this process with a fault injected at one point, then die there.

Usage: python crash_helper.py MODE -- ASK-ARGS...   (LOCALCHAT_HOME from the environment)

MODE: kill-prefill | kill-decode | kill-segment | kill-checkpoint | kill-manifest | kill-reply
| slow-decode.
The faults are injected from outside (monkeypatching), so the product has no test hooks.
"""

import os
import signal
import sys
import time


def die():
    os.kill(os.getpid(), signal.SIGKILL)


def main():
    mode = sys.argv[1]
    args = sys.argv[sys.argv.index("--") + 1:]
    from localchat.cpu import backend

    backend.prepare()
    from localchat import files
    from localchat.model.engine import Engine
    from localchat.store import database as store

    if mode == "kill-prefill":
        real = Engine.prefill

        def prefill(self, tokens, cache, chunk=512, **_stepped):
            gen = real(self, tokens, cache, chunk=4)
            yield next(gen)
            die()
        Engine.prefill = prefill
    elif mode in ("kill-decode", "slow-decode"):
        from localchat.session import speculative

        # Every turn decodes through here, plain or with prompt lookup.
        real_decode = speculative.decode

        def decode(*a, **kw):
            for n, tok in enumerate(real_decode(*a, **kw)):
                if mode == "kill-decode" and n == 3:
                    die()
                if mode == "slow-decode":
                    time.sleep(0.05)
                    print("", end="", flush=True)
                yield tok
        speculative.decode = decode
    elif mode in ("kill-segment", "kill-checkpoint", "kill-manifest"):
        real_replace = os.replace

        def replace(src, dst):
            name = os.path.basename(str(dst))
            if (mode == "kill-segment" and name.startswith("seg-")) or \
               (mode == "kill-checkpoint" and name.startswith("ckpt-")) or \
               (mode == "kill-manifest" and name == "manifest.json"):
                die()
            return real_replace(src, dst)
        files.os.replace = replace
    elif mode == "kill-reply":
        real_add = store.Store.add_message

        def add_message(self, conv, role, content, partial=False, extra=None):
            if role == "assistant":
                die()
            return real_add(self, conv, role, content, partial, extra)
        store.Store.add_message = add_message
    from localchat.cli.main import main as cli_main

    sys.exit(cli_main(args))


if __name__ == "__main__":
    main()
