"""cuattn's lab: the static SASS model and roofline, the NVRTC compile check, the tiny language
model and the KV-cache quality tables. It runs from a checkout (``python -m dev``) and in the test
suite; it is not part of the installed package (see dev/README.md)."""
