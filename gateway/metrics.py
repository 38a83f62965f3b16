"""The gateway's Prometheus metrics, on a registry of its own (one per app instance)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_FAST = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_SLOW = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "darl_gateway_requests",
            "Requests by route (the protocol, or result, events, models, admin, metrics, health) "
            "and status.",
            ["route", "status"],
            registry=self.registry,
        )
        self.upstream_seconds = Histogram(
            "darl_gateway_upstream_seconds",
            "Time from admission to the policy server's full answer, retries included.",
            buckets=_SLOW,
            registry=self.registry,
        )
        self.store_write_seconds = Histogram(
            "darl_gateway_store_write_seconds",
            "Time spent writing a call's record to the trajectory store, on the answer path "
            "(its event reaches the workflow batched, off that path: "
            "darl_gateway_delivery_signals).",
            buckets=_FAST,
            registry=self.registry,
        )
        self.upstream_retries = Counter(
            "darl_gateway_upstream_retries",
            "Retries of policy server calls.",
            registry=self.registry,
        )
        self.captured_calls = Counter(
            "darl_gateway_captured_calls",
            "Model calls recorded, by the protocol the agent spoke (chat.completions, "
            "completions, responses, messages) and whether it streamed.",
            ["protocol", "streamed"],
            registry=self.registry,
        )
        self.failed_calls = Counter(
            "darl_gateway_failed_calls",
            "Model calls that got no answer (recorded as failed, never trained on).",
            ["status"],
            registry=self.registry,
        )
        self.delivered_events = Counter(
            "darl_gateway_delivered_events",
            "Call events delivered to rollout workflows.",
            registry=self.registry,
        )
        self.delivery_signals = Counter(
            "darl_gateway_delivery_signals",
            "model_calls signals sent (each carries a batch of events).",
            registry=self.registry,
        )
        self.replayed_calls = Counter(
            "darl_gateway_replayed_calls",
            "Model calls of resumed attempts answered from an earlier attempt's record "
            "(rule 10); 'normalized': matched only under the rollout's normalizers.",
            ["normalized"],
            registry=self.registry,
        )
        self.unreceived_calls = Counter(
            "darl_gateway_unreceived_calls",
            "Answers recorded that their agent never received (it went away, or its attempt "
            "ended, while the call was at the policy server): no part of the attempt's "
            "trajectory, offered to the next attempt's replay (rule 10).",
            registry=self.registry,
        )
        self.unreceived_replayed = Counter(
            "darl_gateway_unreceived_replayed",
            "Calls of resumed attempts answered from an answer an earlier attempt's agent never "
            "received (generated once, received by this attempt's agent).",
            registry=self.registry,
        )
        self.idempotent_answers = Counter(
            "darl_gateway_idempotent_answers",
            "Model calls answered from the record of the attempt's call made with their "
            "Idempotency-Key (a retried request, never generated twice); 'unreceived': that "
            "call's answer never reached its client, and is recorded now as received.",
            ["unreceived"],
            registry=self.registry,
        )
        self.idempotent_waiting = Gauge(
            "darl_gateway_idempotent_waiting",
            "Retried model calls waiting for the call with their Idempotency-Key still at a "
            "policy server through this gateway.",
            registry=self.registry,
        )
        self.replay_waiting = Gauge(
            "darl_gateway_replay_waiting",
            "Calls of resumed attempts that the record does not hold, waiting for the calls of "
            "the record's attempts still at a policy server (an answer their agent never "
            "received may answer them).",
            registry=self.registry,
        )
        self.replay_divergences = Counter(
            "darl_gateway_replay_divergences",
            "Resumed attempts whose agent asked what the record does not hold while recorded "
            "calls were left (their replay ended early; the calls went live).",
            registry=self.registry,
        )
        self.paused = Gauge("darl_gateway_paused", "1 while paused.", registry=self.registry)
        self.inflight = Gauge(
            "darl_gateway_inflight", "Calls in flight to policy servers.", registry=self.registry
        )
        self.pause_seconds = Histogram(
            "darl_gateway_pause_seconds",
            "Length of each pause (weight sync).",
            buckets=_SLOW,
            registry=self.registry,
        )
