"""The error raised when a weight update cannot be completed."""


class WeightUpdateError(RuntimeError):
    """An update was rejected or interrupted; the receiver kept its previous weight version.

    The message names the update version, the bucket (when one is at fault) and the reason.
    """
