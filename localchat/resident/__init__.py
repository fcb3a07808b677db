"""The resident model: one process per data folder and loaded model that keeps the model in
memory between ``ask``s and runs their turns on ``serve``'s scheduler (issue 48).

- ``place``  where a resident lives (its socket, info and log files), its key, the code's digest
  and the keep-alive; nothing heavy, the client imports it
- ``wire``   the socket's lines: requests checked as a whole, events to and from JSON
- ``client`` what ``ask`` runs when a resident answers: Python, a socket and the printing
- ``daemon`` the resident process itself (``python -m localchat.resident.daemon``)

A front end: it drives the session layer as ``server/`` does.
"""
