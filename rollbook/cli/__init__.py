"""The ``rollbook`` command's entry points: ``main`` (argument parsing and the subcommands),
``store_flags`` (the client flags the store-facing subcommands share), ``query`` (``rollbook
query``), ``report`` (``rollbook report``) and ``demo`` (``rollbook demo``).
``python -m rollbook.cli`` runs ``main``."""
