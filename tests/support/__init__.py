"""Test support: helpers, fakes and the jobs tests launch. Imported as `tests.support.*`."""
