"""A model call's way through the gateway: the proxy (`proxy.py`) admits it (`traffic.py`: pause
and upstreams), replays it (`replay.py`, `replayer.py`) or forwards it (`forwarding.py`,
`versions.py`, `upstream_exchange.py`) and answers it whole or streamed (`stream_relay.py`),
records it (`recording.py`), and delivers it to its rollout's workflow (`delivery.py`,
`rollouts.py`)."""
