"""The HTTP edge, the only layer that imports FastAPI: the app factory (app), the outer
middleware (middleware), who may call what (auth), the endpoints, the rows they show (views),
the status page, uvicorn's connection guards (connection) and the server with drain and
reload (serving)."""
