package main

import (
	"context"

	"github.com/dsec-dev/dsec/internal/agent"
	"github.com/dsec-dev/dsec/internal/runtime/microvm/guestinit"
)

// guestMain is the agent as a microVM guest's /init: set the guest up from
// the Init request on its virtio-serial port, then serve on that port. The
// guest lives exactly as long as this process: on any end it powers off,
// and QEMU (run with -no-reboot) exits, which the backend sees.
func guestMain() {
	g, err := guestinit.Start()
	if err != nil {
		guestinit.PowerOff("set-up failed: " + err.Error())
	}
	absorbSignals()
	opts := g.Options
	opts.OnIdle = releaseWhenIdle()
	err = agent.Serve(context.Background(), g.Conn, opts)
	msg := "the host closed the agent channel"
	if err != nil {
		msg = "agent stopped: " + err.Error()
	}
	guestinit.PowerOff(msg)
}
