"""The obtain path: one way from a request to what answers it (:mod:`.obtainer`), and a
broken stream's next leg by the same path (:mod:`.continuer`)."""

from edgeproxy._obtain.continuer import Continuer
from edgeproxy._obtain.obtainer import Obtained, Obtainer
from edgeproxy._obtain.record import record

__all__ = ["Continuer", "Obtained", "Obtainer", "record"]
