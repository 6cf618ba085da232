"""The app's typed state: one of each service over the app's deployments (the translations over the one chat and
completions services), the settings create_app was given, and state_of for the server around any app."""

from __future__ import annotations

from fastapi import FastAPI

from servelm.compose import build_deployment
from servelm.http.app import AppOptions, create_app
from servelm.http.state import state_of
from servelm.runners.fake import FakeRunner
from servelm.service.registry.deployments import Deployments


def test_create_app_builds_each_service_once_over_its_deployments():
    deployment, _ = build_deployment("fake-model", FakeRunner())
    app = create_app(Deployments([deployment]), AppOptions(timings=True, playground=False))
    state = state_of(app)
    assert state is not None and state.timings and state.catalog is None and set(state.health_reports) == {"kept"}
    s = state.services
    assert s.responses.chat is s.chat and s.messages.chat is s.chat and s.tokens.chat is s.chat
    assert s.responses.conversations is s.conversations
    assert s.native.completions is s.completions and s.ovms_completions is not s.completions
    # every service reads the app's own deployments (each engine wrapped for metrics), not the ones given
    assert {id(x.deployments) for x in (s.chat, s.completions, s.ovms_completions, s.embeddings, s.scores)} == \
        {id(state.deployments)}
    assert state.deployments.get("fake-model").engine is not deployment.engine
    assert state_of(FastAPI()) is None and state_of(object()) is None
