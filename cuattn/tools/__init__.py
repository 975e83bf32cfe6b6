"""The command line and its jobs: ``cuattn check``, ``show``, ``compile`` and ``bench``."""
