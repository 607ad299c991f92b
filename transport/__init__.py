"""asyncio drivers that move secagg messages: MQTT (aiomqtt), in-memory, embedded broker.

Imports ``secagg`` only.
"""
