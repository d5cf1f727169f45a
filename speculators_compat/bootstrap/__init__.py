"""The directory ``speculators-compat run`` puts first on ``PYTHONPATH``: its ``sitecustomize``
imports speculators_compat in every Python process started under the launcher (launcher.py)."""
