"""The Celery app Flower loads (``celery -A shared.flower_app flower``): Conveyor's own app
from the settings, so Flower knows the ``rollouts`` and ``scoring`` queues and shows their
depth on its Broker page, not only Celery's default queue.

Invariant: the broker URL Flower reads back from the app is a plain ``redis://`` one. Flower
picks its queue-length client by the URL's scheme, and the workers' outage-aware transport
(``shared.celery_app.OutageRedisTransport``) would name itself there instead ("'redis' broker
is not supported"). Flower only observes, so it has no use for that transport.
"""

from __future__ import annotations

from shared.celery_app import make_celery
from shared.settings import load_settings

app = make_celery(load_settings())
app.conf.broker_transport = None
