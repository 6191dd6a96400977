"""A full disk, simulated for the tests of what a failed write leaves behind."""

import builtins
import errno


class FullDiskFile:
    """An open file on a full disk: the first ``fits`` characters of a write reach it, then the
    write fails with ENOSPC (as a real one does once the disk fills)."""

    def __init__(self, file, fits: int = 0):
        self.file, self.fits = file, fits

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.file.close()

    def write(self, text: str):
        self.file.write(text[: self.fits])
        raise OSError(errno.ENOSPC, "No space left on device")

    def writelines(self, lines):
        self.write("".join(lines))


def full_disk_open(on_full_disk, fits: int = 0):
    """An ``open`` whose files for writing whose path ``on_full_disk(path)`` accepts are on a full disk."""
    real_open = builtins.open

    def opener(path, mode="r", *args, **kwargs):
        file = real_open(path, mode, *args, **kwargs)  # noqa: SIM115 (closed by its user)
        return FullDiskFile(file, fits) if "w" in mode and on_full_disk(str(path)) else file

    return opener
