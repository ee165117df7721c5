"""The one place where lctrain touches library internals or API that differs between supported versions: one module
per library, each use naming the versions it was written against (docs/design.md §6)."""
