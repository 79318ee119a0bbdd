"""FedPer (Arivazhagan, Aggarwal, Singh, Choudhary, "Federated Learning with Personalization Layers", arXiv
1912.00818, 2019): FedAvg on the *base* layers, while the top K_P *personalization* layers stay on each client.

Client j's model f(x; W_B, W_Pj) is split into base layers W_B (bottom, shared by all clients) and the top K_P
layers W_Pj (its own). Round k, for the round's participants S_k (the paper's client and server algorithms):

    client j:  (W_B, W_Pj) <- (W_B^(k-1), W_Pj)                 receive the base, keep its personalization layers
               (W_Bj^(k), W_Pj) <- E epochs of SGD on L_j(W_B, W_Pj)    both parts trained jointly
               send W_Bj^(k)
    server:    W_B^(k) = sum_{j in S_k} n_j W_Bj^(k) / sum_{j in S_k} n_j        (FedAvg on the base only)

and client j is evaluated with f(x; W_B^(k), W_Pj): the current global base under its own personalization layers.

The same machinery serves LG-FedAvg (:mod:`rayfl.algorithms.lgfedavg`), the opposite split (the top layers
shared, the bottom ones personal): :class:`~rayfl.algorithms.common.SplitClient` is FedAvg's client with a mask of *shared* entries of
the flat weight vector; FedPer shares all but the top K_P layers.

How it is computed, and the choices where the paper is silent:
- The server is FedAvg's, unchanged: it averages the whole uploaded vector, size-weighted. A client, receiving
  the global vector, overwrites only the shared entries of its own model (:func:`~rayfl.algorithms.common.with_shared`), so the
  averaged personal entries travel but are never read. The paper sends only W_B; the communication it saves is
  not modelled here (a run's logged vectors are full size). The run's final "global" model is that average:
  its base is W_B, its personal entries mean nothing; a client's personalized model is its own vector with
  the global's shared entries.
- A "layer" is a module owning parameters directly (a Linear, a Conv2d; :mod:`rayfl.algorithms.layers`). The
  paper counts "blocks" of MobileNet-v1 / ResNet-34 (K_P = 1: the final fully connected layer alone); rayfl's
  models are plain stacks, one Linear or Conv2d per block.
- K_P's default: the paper studies 1 to 4 personalization layers (its ablation, Fig. 4) and sets no general
  rule; 2 is the default of Flower's reproduction of its CIFAR-10 runs (FedPer's authors published no code).
  ``personal_layers=0`` means that default: 2, capped at L - 1 for a model of L layers so that a base is left
  to share (rayfl's MLPs have 2 layers: there K_P = 1, the output layer). PFLlib and FL-bench personalize the
  last layer only (K_P = 1).
- Initialisation: the paper's client initialises its own W_Pj; here every client starts from the run's common
  initial model (FedAvg's starting point), so that FedPer and FedAvg start equal; the personal layers part
  ways from the first local training.
- Local work per round is FedAvg's (the run's epochs, batch size, optimizer and lr; Flower's reproduction of
  the CIFAR runs: SGD, lr 0.01, 4 epochs, batch 128). Non-participants keep their model as it is; a
  participant's personal layers are exactly what its last local training left.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rayfl.algorithms.base import Algorithm
from rayfl.algorithms.baselines import FedAvgClient, FedAvgServer
from rayfl.algorithms.common import SplitClient, check_layers, check_split, split_size
from rayfl.algorithms.layers import layer_slices, top_mask


# ------------------------------------------------------------------------------------------- knobs

@dataclass
class FedPerParams:
    personal_layers: int = 0  # K_P, the top layers kept on each client; 0: the default, 2 capped at L-1 (Fig. 4)

    def check(self, n_clients: int) -> None:
        check_layers("personal_layers", self.personal_layers)

    def check_run(self, info, model) -> None:
        check_split("personal_layers", self.personal_layers, info.model, model, "FedPer",
                    "a shared base and a personal head")


# ------------------------------------------------------------------------------------------- the split

def base_mask(model, k_p: int) -> np.ndarray:
    """FedPer's shared entries: every layer but the top K_P personalization layers (the base W_B)."""
    return ~top_mask(model, split_size(k_p, len(layer_slices(model))))


# ------------------------------------------------------------------------------------------- driver

class FedPerServer(FedAvgServer):
    """FedAvg's server, unchanged. It does not declare ``Server.averages`` (user-level DP): an upload's personal
    entries are the client's own layers, not an update of the global model's, so clipping θ_k - θ would spend
    the clip norm on them."""


# ------------------------------------------------------------------------------------------- client

class FedPerClient(SplitClient, FedAvgClient):
    private_training = True  # every step trains through client.fit (rayfl.privacy)

    def shared_mask(self, model):
        return base_mask(model, self.params.personal_layers)


ALGORITHMS = [Algorithm("fedper", FedPerParams, FedPerServer, FedPerClient,
                        "FedAvg on the base layers, personalization layers kept local (Arivazhagan et al. 2019)")]
