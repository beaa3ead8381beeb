"""The models one server answers with, by id: each a ServedModel with a Scheduler of its own.

A Scheduler's worker thread owns one model, so each model gets one: requests for different models
run side by side (each in its own thread, on the same cores), requests for one model are batched
by its scheduler as before, and `--max-batch-size` and `--max-queue` hold per model. A request is
routed by its `model` field; an id no model answers as is a 404 that lists the ids there are.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from stages.errors import InputError
from stages.serving.openai_api import RequestError
from stages.serving.scheduler import Scheduler
from stages.serving.served_model import ServedModel


@dataclass(frozen=True)
class Route:
    """One model of the server and the scheduler that runs it."""

    served: ServedModel
    scheduler: Scheduler


class ModelSet:
    """The server's models in the order they were given (the order /v1/models lists them)."""

    def __init__(self, routes: Sequence[Route]):
        if not routes:
            raise InputError("a server needs at least one model (--model DIR or --experiment DIR)")
        self._routes: dict[str, Route] = {}
        for route in routes:
            if route.served.model_id in self._routes:
                raise InputError(f"two models would be served as {route.served.model_id!r}; give each its own "
                                 "--served-model-name")
            self._routes[route.served.model_id] = route

    @classmethod
    def start(cls, models: Sequence[ServedModel], *, max_batch_size: int, max_queue: int,
              compile: bool = False) -> ModelSet:
        """Start a Scheduler (its worker thread) for each model; none is left running on an error.
        `compile`: each model's decode steps compiled (Scheduler's `compile`)."""
        routes: list[Route] = []
        try:
            for served in models:
                routes.append(Route(served, Scheduler(served.model, eos_token_id=served.eos_token_id,
                                                      pad_token_id=served.pad_token_id,
                                                      max_batch_size=max_batch_size, max_queue=max_queue,
                                                      compile=compile)))
            return cls(routes)
        except BaseException:
            for route in routes:
                route.scheduler.close()
            raise

    @property
    def ids(self) -> list[str]:
        return list(self._routes)

    def __len__(self) -> int:
        return len(self._routes)

    def __iter__(self) -> Iterator[Route]:
        return iter(self._routes.values())

    def route(self, model_id: str) -> Route:
        """The model a request names; RequestError 404 naming the ids served when there is none."""
        route = self._routes.get(model_id)
        if route is None:
            raise RequestError(404, f"model {model_id!r} is not served here; this server answers as "
                                    f"{', '.join(repr(i) for i in self._routes)} (GET /v1/models)", "model")
        return route

    def health(self) -> dict[str, Any]:
        """/health: totals over the models, and each model's kind and counts."""
        models = {i: {"kind": r.served.kind, "waiting_or_running": r.scheduler.admitted,
                      "finished": dict(r.scheduler.finished)} for i, r in self._routes.items()}
        finished = sum((Counter(m["finished"]) for m in models.values()), Counter())
        out = {"status": "ok", "waiting_or_running": sum(m["waiting_or_running"] for m in models.values()),
               "finished": dict(finished), "models": models}
        if len(models) == 1:  # a one-model server's /health as before several models: its id under "model"
            out["model"] = next(iter(models))
        return out

    def close(self) -> None:
        """Stop every scheduler's worker."""
        for route in self._routes.values():
            route.scheduler.close()
