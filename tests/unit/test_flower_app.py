"""Flower's Broker page and /api/queues/length read the queue depths through the app that
``shared.flower_app`` builds: with Flower's own broker client, against a real Redis."""

from __future__ import annotations

import asyncio
import importlib
import sys

from flower.utils.broker import Broker

from shared.celery_app import make_celery
from shared.names import ROLLOUT_QUEUE, ROLLOUT_TASK, SCORING_QUEUE
from shared.settings import load_settings


def _flower_app(monkeypatch, redis_url):
    monkeypatch.setenv("CONVEYOR_REDIS__URL", redis_url)
    sys.modules.pop("shared.flower_app", None)
    return importlib.import_module("shared.flower_app").app


def test_flower_reads_the_conveyor_queue_depths(monkeypatch, redis_url, redis_client):
    app = _flower_app(monkeypatch, redis_url)
    with app.connection() as conn:
        uri = conn.as_uri(include_password=True)
    assert uri.startswith("redis://"), uri
    workers_app = make_celery(load_settings())
    for _ in range(3):
        workers_app.send_task(ROLLOUT_TASK, args=[{}], queue=ROLLOUT_QUEUE)
    broker = Broker(uri, broker_options=app.conf.broker_transport_options, broker_use_ssl=None)
    depths = {q["name"]: q["messages"] for q in asyncio.run(broker.queues([ROLLOUT_QUEUE, SCORING_QUEUE]))}
    assert depths == {ROLLOUT_QUEUE: 3, SCORING_QUEUE: 0}
