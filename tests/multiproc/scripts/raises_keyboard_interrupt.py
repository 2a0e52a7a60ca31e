"""A script that raises KeyboardInterrupt itself (no Ctrl-C): its own error, shown as python shows it."""


def cancel():
    raise KeyboardInterrupt("cancelled by the script")


cancel()
