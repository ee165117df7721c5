"""Tools for lctrain's developers, not shipped in the package: the GPU check (`gpu_check`) and the offline wheelhouse
it installs from (`wheelhouse`)."""
