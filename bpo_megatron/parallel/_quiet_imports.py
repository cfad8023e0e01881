"""Imported first by the local-world fork server, so every rank forked from it starts with the
third-party noise silenced (see ``bpo_megatron.observability.library_logs``)."""

from bpo_megatron.observability.library_logs import quiet_library_logs

quiet_library_logs()
