"""The DARL gateway: an OpenAI-compatible proxy between agents and policy servers that forces
token ids and logprobs, stores every model call and signals it into the rollout's workflow.
The package reads top-down:

    app.py          create_app: the routes over one Gateway
    routes/         the agents' routes (model APIs, result, Agent Lightning), the admin API
    state.py        Gateway and GatewaySettings: the state the routes share
    protocols/      chat/, responses/, messages/: request models, translation, streams
    calls/          a call's way: proxy, stream relay, traffic, forwarding, versions, replay,
                    recording, delivery
    store/          the trajectory store: interface, record, directory, S3, codec, URL
    journal/        the gateway's own durable state
    errors.py       the typed error tree; defaults.py, metrics.py, auth.py, tracing.py;
                    lru.py, the bounded LRU map of every per-rollout cache

Nothing below app.py imports it or a route (tests/unit/test_layering.py checks).
"""
