package controlplane

// LiveNodes is how many nodes heartbeat in time now. `dsec up` reports
// itself healthy only once its own edge is one of them: before that every
// create would fail with "no node offers backend ...".
func (s *Server) LiveNodes() int {
	alive, _ := s.reg.nodeCounts()
	return alive
}
