"""Prometheus metrics of the OpenAI-compatible server (/metrics)."""

from __future__ import annotations

from .engine import Engine

ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")


class Metrics:
    """HTTP-level counters; generation totals come from ``Engine.stats()`` at scrape time."""

    def __init__(self) -> None:
        self.requests: dict[tuple[str, int], int] = {}
        self.disconnects = 0
        self.in_flight = 0  # admitted generation requests, running or queued

    def observe(self, path: str, status: int) -> None:
        key = (path if path in ENDPOINTS else "other", status)
        self.requests[key] = self.requests.get(key, 0) + 1

    def render(self, engine: Engine) -> str:
        st = engine.stats()
        lines: list[str] = []

        def metric(name: str, kind: str, help: str, samples: list[tuple[str, float]]) -> None:
            lines.extend([f"# HELP {name} {help}", f"# TYPE {name} {kind}"])
            lines.extend(f"{name}{labels} {value:.10g}" for labels, value in samples)

        def by_status(errors: bool) -> list[tuple[str, float]]:
            return [(f'{{endpoint="{p}",status="{s}"}}', n) for (p, s), n in sorted(self.requests.items())
                    if not errors or s >= 400]

        metric("specdeploy_requests_total", "counter", "HTTP requests by endpoint and status.", by_status(False))
        metric("specdeploy_errors_total", "counter", "HTTP responses with status >= 400.", by_status(True))
        scalars = [
            ("client_disconnects_total", "counter", "Generation requests whose client went away before the end.",
             self.disconnects),
            ("requests_in_flight", "gauge", "Generation requests admitted (running or queued).", self.in_flight),
            ("queue_depth", "gauge", "Generations waiting for the decode slot.", st.queue_depth),
            ("generation_running", "gauge", "1 while a generation holds the decode slot.", st.running),
            ("generations_total", "counter", "Generations that reached the decode slot.", st.generations),
            ("generations_cancelled_total", "counter", "Generations closed before their end.", st.cancelled),
            ("prompt_tokens_total", "counter", "Prompt tokens prefilled.", st.prompt_tokens),
            ("generated_tokens_total", "counter", "Tokens generated.", st.new_tokens),
            ("decode_steps_total", "counter", "Target forward passes after the prefills.", st.steps),
            ("busy_seconds_total", "counter", "Seconds the decode slot was held.", st.busy_s),
            ("tokens_per_second", "gauge", "Generated tokens per busy second, since start.", st.tokens_per_s),
            ("last_tokens_per_second", "gauge", "Tokens per second of the last generation.", st.last_tokens_per_s),
            ("tau", "gauge", "Mean tokens per decode step (tau), since start.", st.tau),
            ("last_tau", "gauge", "Mean tokens per decode step of the last generation.", st.last_tau),
        ]
        for name, kind, help, value in scalars:
            metric(f"specdeploy_{name}", kind, help, [("", value)])
        return "\n".join(lines) + "\n"
