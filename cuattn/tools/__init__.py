"""The command line and its jobs (``cuattn check``, ``show``, ``bench``) and the float64
oracle they check against. The lab (static SASS model, compile check, tiny LM) is dev/."""
