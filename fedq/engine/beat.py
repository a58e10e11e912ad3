"""The watchdog's beat: Celery's persistent schedule, with a file whose time says beat is
alive.

docker/compose.yaml's beat healthcheck (beat answers no ping) asks whether the schedule's
file changed in the last 5 minutes. Celery writes the schedule through :mod:`shelve`,
and a sync (every 3 minutes, Celery's ``Scheduler.sync_every``) reaches the file with
``dbm.gnu`` or ``dbm.dumb`` but not with ``dbm.ndbm`` (Berkeley DB, what Debian's Python
in fedq's images built here uses), which keeps the writes until the file is closed: a
running beat looked unhealthy 5 minutes after it started. :class:`BeatSchedule` sets
the files' time at every sync, whichever dbm holds them."""

from __future__ import annotations

import glob
import os

from celery.beat import PersistentScheduler


class BeatSchedule(PersistentScheduler):
    """:class:`celery.beat.PersistentScheduler` whose every sync also touches the
    schedule's files (``FILENAME`` and ``FILENAME.*``, whichever dbm made them)."""

    def sync(self) -> None:
        super().sync()
        for path in glob.glob(glob.escape(self.schedule_filename) + "*"):
            try:
                os.utime(path)
            except OSError:  # removed meanwhile: the next sync makes it again
                pass
