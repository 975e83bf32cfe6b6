"""The command line and its jobs (``cuattn check``, ``show``, ``compile``, ``bench``), the
static SASS model, and the tiny demo transformer (``tinylm``, its tape ops in ``tinylm_ops``)."""
