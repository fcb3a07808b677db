"""One model over several processes or machines: rank 0 (the user's process) and followers.

What it is: how the ranks of ``--hosts`` / ``--hostfile`` stay in step, and how a model is
split. The process in the user's terminal is rank 0: it owns the screen, the database and the
turn logic. ``launch.py`` starts one follower per other host
(``python -m localchat.cluster.follower``) and joins them with MLX's ring backend; each model
is split with mlx-lm's ``model.shard`` (heads: ``tensor``) or ``model.model.pipeline``
(layers: ``pipeline``).

How the ranks stay in step: before each turn rank 0 sends every follower, over a small TCP
control link, the call it is about to make (``Session.turn`` with a copy of the conversation's
stored messages, or ``Session.complete`` for a batch line). A follower runs the same session
code on its own shard, with its own KV cache folder, so every model call happens on every rank
in the same order. Where a rank's local state could differ (its cache on disk, a write that
failed, a Ctrl-C that only rank 0 saw) the session asks the group to agree: ``gather``
(every rank's few integers), ``agree_all``, ``agree_any`` are MLX collectives over every
rank, each tagged with a running count so that ranks out of step are caught, not trusted;
``from_root`` makes rank 0's sampled token the one every rank feeds. After each call a
follower reports how many agreements it made; a mismatch stops the program with one line.

Failure: followers send a heartbeat every second. A follower that exits, closes its link or
stays silent for ``LOCALCHAT_FOLLOWER_TIMEOUT`` seconds (default 10) ends rank 0 with one line
(``localchat: error: rank 1 (127.0.0.1) …``) soon after: a turn blocked in a collective
first saves the partial reply (``Ring.on_lost``); followers exit when rank 0's link closes.

The control link opens with a mutual HMAC handshake on a per-run secret (``handshake_rank0``,
``handshake_follower``): only followers this rank 0 started get in, and a follower obeys only
its own rank 0. MLX's ring itself is not authenticated: it belongs on a private network.

The modules: ``group.py`` (``Solo`` and ``Ring``: the agreements, the commands to followers,
each rank's folders), ``control.py`` (the control link: JSON lines and the handshake),
``split.py`` (which models split how, and the split itself), ``launch.py`` (rank 0 starts
and watches the followers), ``follower.py`` (a follower's loop).

What it is not: a scheduler. One conversation runs at a time, as in a single process.
``Solo`` is the one-process group every session gets by default; its agreements cost nothing.
"""

