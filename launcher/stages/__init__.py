"""Pipeline stages: one plain module each, run on every rank by ``launcher.worker``."""
