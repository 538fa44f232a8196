"""The AssistantService servicer, one class assembled from one module per concern.

- `turn_start`: StartTurn (guards, model, admission, persist-and-charge, unwind) and CheckModel.
- `interrupts`: Resume and NotifyCredentialConnected (answer a question, start the continuation).
- `streams`: StreamRun and StreamRuns (`run_streams`).  `cancel`: Cancel.
- `chats`: GetChat, ListChats, GetChatStatus, DeleteChat.
- `model_providers`: ListModelProviders (the providers and models this deployment serves).
- `access`: the state they share (claims, the caller's chat, its pending question, the model).

Each concern is a mixin of `ChatAccess`, so every RPC is a plain method of `AssistantServicer`:
gRPC binds it once and calls it with no delegation hop, and each module reads on its own.
"""

from __future__ import annotations

from services.orchestrator.servicer.cancel import Cancels
from services.orchestrator.servicer.chats import Chats
from services.orchestrator.servicer.interrupts import Interrupts
from services.orchestrator.servicer.model_providers import ModelProviders
from services.orchestrator.servicer.streams import Streams
from services.orchestrator.servicer.turn_start import TurnStart


class AssistantServicer(TurnStart, Interrupts, Streams, Cancels, Chats, ModelProviders):
    """Implements loopline.assistant.v1.AssistantService over the orchestrator database."""
