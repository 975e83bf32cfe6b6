"""The kernels a backend launches, recorded in order."""

from __future__ import annotations


def record_launches(monkeypatch, backend_class) -> list[str]:
    """Every kernel ``backend_class`` (InterpBackend, CudaBackend) launches from now on, by name,
    appended to the list returned; the launches themselves run as before."""
    names: list[str] = []
    launch = backend_class.launch

    def spy(self, config, **values):
        names.append(config.kernel)
        return launch(self, config, **values)

    monkeypatch.setattr(backend_class, "launch", spy)
    return names
