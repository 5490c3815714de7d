"""Test helpers for the CLI tests: target loading patched in process."""


def load_each_target_once(monkeypatch, cache: dict) -> None:
    """The CLI's first load of a target goes through its own loader; later runs reuse that model (``cache``:
    spec -> model, kept by the calling test module)."""
    import speculum.cli.enumerate as enumerate_cli

    load = enumerate_cli.load_target

    def cached(spec, **options):
        if spec not in cache:
            cache[spec] = load(spec, **options)
        return cache[spec]

    monkeypatch.setattr(enumerate_cli, "load_target", cached)
